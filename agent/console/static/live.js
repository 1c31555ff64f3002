// The console's live pages: every few seconds the page is fetched again and each of its
// [data-live] parts (found by id) is swapped in, so numbers move without a reload and a form
// being filled in is left alone; a page that became another kind of page (a rollout queued to
// start that the leader started) is loaded whole. A failed fetch (the console restarting, a lost session) is
// tried again on the next tick; the page says when it last updated.
(function () {
  "use strict";
  var every = Number(document.body.getAttribute("data-refresh") || 0) * 1000;
  if (!every) { return; }
  var stamp = document.getElementById("updated");
  function tick() {
    fetch(location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
      .then(function (text) {
        var doc = new DOMParser().parseFromString(text, "text/html");
        if (doc.body.getAttribute("data-page") !== document.body.getAttribute("data-page")) {
          location.reload();
          return;
        }
        document.querySelectorAll("[data-live]").forEach(function (el) {
          var fresh = doc.getElementById(el.id);
          if (fresh) { el.replaceWith(document.importNode(fresh, true)); }
        });
        // the server's moment, as every time on the page is written (not the browser's locale)
        if (stamp) { stamp.textContent = "updated " + (doc.body.getAttribute("data-now") || ""); }
        document.body.setAttribute("data-updates", String(Number(document.body.getAttribute("data-updates") || 0) + 1));
      })
      .catch(function (why) { if (stamp) { stamp.textContent = "not updated (" + why + "): trying again"; } })
      .then(function () { setTimeout(tick, every); });
  }
  setTimeout(tick, every);
}());
