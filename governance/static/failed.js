// An in-place request (htmx) the server refused or never answered says so on the page. htmx
// leaves an error answer unswapped and a lost request silent, so a click on "Kill this run"
// while the server was busy (a 503 for a read past its deadline, a 429) looked like a click
// that did nothing. The message names what the server said (its page's heading and first
// paragraph, or its JSON error's message), and goes at the next answer that succeeds.
(function () {
  "use strict";
  var ID = "request-failed";

  function show(text) {
    var main = document.querySelector("main");
    if (!main) return;
    var list = document.getElementById(ID);
    if (!list) {
      list = document.createElement("ul");
      list.id = ID;
      list.className = "messages";
      list.setAttribute("role", "alert");
      main.insertBefore(list, main.firstChild);
    }
    var item = document.createElement("li");
    item.className = "message message-error";
    item.textContent = text;  // the server's words as text, never as markup
    list.replaceChildren(item);
  }

  function said(xhr) {
    var type = xhr.getResponseHeader("Content-Type") || "";
    var body = xhr.responseText || "";
    if (type.indexOf("json") !== -1) {
      try {
        var data = JSON.parse(body);
        var error = data && data.error;  // the API's envelope (SPEC 5.3)
        if (error && typeof error.message === "string") return error.message;
        if (data && typeof data.detail === "string") return data.detail;
      } catch (e) { /* not JSON after all: the status line below */ }
    } else if (type.indexOf("html") !== -1) {
      var page = new DOMParser().parseFromString(body, "text/html");
      var parts = ["h1", "p"].map(function (tag) {
        var el = page.querySelector(tag);
        return el ? el.textContent.replace(/\s+/g, " ").trim() : "";
      }).filter(Boolean);
      if (parts.length) return parts.join(": ");
    }
    return "";
  }

  function refused(evt) {
    var xhr = evt.detail.xhr;
    var retry = xhr.getResponseHeader("Retry-After");
    var text = "The server answered " + xhr.status +
      (xhr.statusText ? " (" + xhr.statusText + ")" : "") + " instead of what was asked.";
    var words = said(xhr);
    if (words) text += " " + words;
    if (retry && /^\d+$/.test(retry)) text += " Try again in " + retry + " s.";
    show(text);
  }

  function unreached() {
    show("The server could not be reached: check the connection and try again.");
  }

  function answered(evt) {
    if (evt.detail.successful) {
      var list = document.getElementById(ID);
      if (list) list.remove();
    }
  }

  // htmx fires a request's outcome on the element that made it. A live page's stream may
  // replace that element while the request is out (the run page's first full look renders
  // its controls again, kill button included), and an event on an element no longer in the
  // page never reaches the document: the refusal went unsaid (found by a CI run). So the
  // listeners go on each element as it sends, where they hear its outcome wherever it is.
  var listening = new WeakSet();
  document.addEventListener("htmx:beforeRequest", function (evt) {
    var elt = evt.target;
    if (!elt || listening.has(elt)) return;
    listening.add(elt);
    elt.addEventListener("htmx:responseError", refused);
    elt.addEventListener("htmx:sendError", unreached);
    elt.addEventListener("htmx:afterRequest", answered);
  });
})();
