// Live screens: shows the state of the server-sent event stream and keeps it resumable.
// Loaded as a static file (the CSP allows no inline script); htmx's sse extension does the
// swapping, this only listens to its events.
(function () {
  "use strict";
  var GRACE_MS = 2500; // a stream ends every minute by design: only a longer gap is news
  var LABELS = {
    connecting: "Connecting…",
    live: "Live",
    down: "Disconnected, reconnecting…",
    ended: "Finished",
    // A run that stopped but was not finished: its page stays live for the response the
    // agent may still report (found by a newcomer: a stopped run read "Live").
    waiting: "Ended, no response yet",
  };
  var downTimer = null;
  var current = null;

  function show(state) {
    var el = document.querySelector("[data-live-status]");
    if (!el) return;
    current = state;
    var status = document.querySelector("#run-header [data-run-status]");
    if (state === "live" && status && status.dataset.runStatus !== "running") state = "waiting";
    el.dataset.state = state;
    el.textContent = LABELS[state];
  }

  // The run's header may say it ended since: the badge follows it.
  document.addEventListener("htmx:sseMessage", function () {
    if (current === "live") show("live");
  });

  document.addEventListener("htmx:sseOpen", function () {
    clearTimeout(downTimer);
    downTimer = null;
    show("live");
  });

  document.addEventListener("htmx:sseError", function () {
    if (downTimer === null) {
      downTimer = setTimeout(function () { downTimer = null; show("down"); }, GRACE_MS);
    }
  });

  document.addEventListener("htmx:sseClose", function (evt) {
    if (evt.detail && evt.detail.type === "message") {
      clearTimeout(downTimer);
      show("ended");
    }
  });

  // A timeline row already on the page (same decision id) is not appended twice.
  document.addEventListener("htmx:sseBeforeMessage", function (evt) {
    var message = evt.detail;
    if (message && message.type === "step" && message.lastEventId &&
        document.getElementById("step-" + message.lastEventId)) {
      evt.preventDefault();
    }
  });

  // The browser resends Last-Event-ID when it reconnects by itself; when the extension has to
  // build a new EventSource (after a hard failure) that id would be lost, so the stream URL
  // carries it too.
  document.addEventListener("htmx:sseMessage", function (evt) {
    var message = evt.detail;
    if (!message || !message.lastEventId) return;
    var source = evt.target.closest("[sse-connect]");
    if (!source) return;
    var url = new URL(source.getAttribute("sse-connect"), window.location.href);
    url.searchParams.set("after", message.lastEventId);
    source.setAttribute("sse-connect", url.pathname + url.search);
  });

  // The server answers an in-place kill with HX-Trigger: killswitch-changed. The run's kill
  // button goes (the switch is engaged; the confirmation box below says so).
  document.body.addEventListener("killswitch-changed", function () {
    var button = document.getElementById("kill-run");
    if (button) button.remove();
  });
})();

// Approvals (SPEC 11): every countdown shows the time left until its request expires. The
// server renders the expiry itself, so a live update never changes only because time passed.
(function () {
  "use strict";
  function pad(n) { return n < 10 ? "0" + n : String(n); }
  function tick() {
    var now = Date.now();
    document.querySelectorAll("time.countdown[data-expires-at]").forEach(function (el) {
      var left = Math.floor((Date.parse(el.dataset.expiresAt) - now) / 1000);
      if (isNaN(left)) return;
      if (left <= 0) {
        el.textContent = "expired";
        el.dataset.left = "0";
        return;
      }
      var h = Math.floor(left / 3600), m = Math.floor((left % 3600) / 60), s = left % 60;
      el.textContent = (h ? h + ":" + pad(m) : m) + ":" + pad(s) + " left";
      el.dataset.left = String(left);
    });
  }
  tick();
  setInterval(tick, 1000);
  document.addEventListener("htmx:afterSwap", tick);
})();

// A running run's Time counter ticks here, from the seconds the server rendered it with (not
// the server's clock: the browser's may differ), so its page's stream sends the counters only
// when a check changed them, not every look because a second passed.
(function () {
  "use strict";
  var shownAt = new WeakMap();  // each rendering of a counter: when this page first saw it
  function tick() {
    var now = performance.now();
    document.querySelectorAll("[data-ticks-from]").forEach(function (el) {
      var from = parseFloat(el.dataset.ticksFrom);
      if (isNaN(from)) return;
      if (!shownAt.has(el)) shownAt.set(el, now);
      var seconds = from + (now - shownAt.get(el)) / 1000;
      var value = el.querySelector(".counter-head strong");
      var limitText = el.dataset.limitText;
      if (value) value.textContent = Math.round(seconds) + " s" + (limitText ? " / " + limitText : "");
      var limit = parseFloat(el.dataset.ticksLimit);
      if (!(limit > 0)) return;
      var ratio = seconds / limit;
      var bar = el.querySelector(".bar-fg");
      if (bar) bar.setAttribute("width", String(Math.round(Math.min(ratio, 1) * 1000) / 10));
      el.classList.remove("level-ok", "level-warn", "level-over");
      el.classList.add("level-" + (ratio >= 1 ? "over" : ratio >= 0.75 ? "warn" : "ok"));
    });
  }
  tick();
  setInterval(tick, 1000);
  document.addEventListener("htmx:afterSwap", tick);
  document.addEventListener("htmx:sseMessage", tick);
})();

// A refused decision (409: another decision won or the request expired; 422: a denial
// without a note) comes back as the card's region (or the card) with the reason on the
// card: show it in place. htmx leaves 4xx answers unswapped by default.
document.addEventListener("htmx:beforeSwap", function (evt) {
  var status = evt.detail.xhr && evt.detail.xhr.status;
  var target = evt.detail.target;
  if ((status === 409 || status === 422) && target && target.matches &&
      target.matches("[data-decide-region], .approval")) {
    evt.detail.shouldSwap = true;
    evt.detail.isError = false;
  }
});

// A decision region (the approvals list, a run's approval card) does not change under the
// operator's hand (found by a newcomer: a request decided elsewhere left the list, the next
// one moved up under the mouse, and the click approved that one instead). While the pointer
// moves over one of its cards (and for HOLD_MS after it last moved there), or a note is being
// typed in it, a live update of the region is held; the latest one is applied as soon as the
// hand is gone. A pointer left resting on a card (after a click, or a walk away) no longer
// holds it after HOLD_MS, so the list never stays stale. A decision sent meanwhile redraws the
// region with its own, newer answer: what was held is then dropped.
(function () {
  "use strict";
  var HOLD_MS = 5000;
  var held = new Map();  // region -> the latest update held for it
  var lastMove = 0, lastTyping = 0;
  document.addEventListener("pointermove", function (evt) {
    if (evt.target.closest && evt.target.closest("[data-decide-region] .approval")) {
      lastMove = Date.now();
    }
  });
  document.addEventListener("input", function (evt) {
    if (evt.target.closest && evt.target.closest("[data-decide-region]")) lastTyping = Date.now();
  });
  function busy(region) {
    var now = Date.now();
    if (now - lastMove < HOLD_MS && region.querySelector(".approval:hover")) return true;
    var active = document.activeElement;
    return Boolean(now - lastTyping < HOLD_MS && active && active.matches("textarea, input") &&
                   region.contains(active));
  }
  document.addEventListener("htmx:sseBeforeMessage", function (evt) {
    var region = evt.target;
    if (!region.matches || !region.matches("[data-decide-region]") || !busy(region)) return;
    evt.preventDefault();
    held.set(region, evt.detail.data);
    region.dataset.held = "true";
  });
  function release() {
    held.forEach(function (content, region) {
      if (busy(region) && document.body.contains(region)) return;
      held.delete(region);
      delete region.dataset.held;
      if (document.body.contains(region)) htmx.swap(region, content, {swapStyle: "innerHTML"});
    });
  }
  setInterval(release, 250);
  document.addEventListener("htmx:beforeRequest", function (evt) {
    held.forEach(function (_, region) {
      if (region.contains(evt.target)) {
        held.delete(region);
        delete region.dataset.held;
      }
    });
  });
})();
