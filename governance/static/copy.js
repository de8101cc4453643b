// A "Copy" button next to a value shown once (a new key's token, a webhook secret):
// <button data-copy="#element-id">. A static file: the CSP allows no inline script.
(function () {
  "use strict";
  document.addEventListener("click", function (evt) {
    var button = evt.target.closest("[data-copy]");
    if (!button) return;
    var source = document.querySelector(button.getAttribute("data-copy"));
    if (!source) return;
    var text = source.textContent.trim();
    var done = function () {
      button.textContent = "Copied";
      button.dataset.copied = "true";
      setTimeout(function () { button.textContent = "Copy"; }, 2000);
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, function () { select(source); });
    } else {
      select(source);  // plain http on another host: select it for Ctrl+C
      try { if (document.execCommand("copy")) done(); } catch (e) { /* selected anyway */ }
    }
  });
  function select(el) {
    var range = document.createRange();
    range.selectNodeContents(el);
    var sel = window.getSelection();
    sel.removeAllRanges();
    sel.addRange(range);
  }
})();
