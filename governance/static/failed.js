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

  document.addEventListener("htmx:responseError", function (evt) {
    var xhr = evt.detail.xhr;
    var retry = xhr.getResponseHeader("Retry-After");
    var text = "The server answered " + xhr.status +
      (xhr.statusText ? " (" + xhr.statusText + ")" : "") + " instead of what was asked.";
    var words = said(xhr);
    if (words) text += " " + words;
    if (retry && /^\d+$/.test(retry)) text += " Try again in " + retry + " s.";
    show(text);
  });

  document.addEventListener("htmx:sendError", function () {
    show("The server could not be reached: check the connection and try again.");
  });

  document.addEventListener("htmx:afterRequest", function (evt) {
    if (evt.detail.successful) {
      var list = document.getElementById(ID);
      if (list) list.remove();
    }
  });
})();
