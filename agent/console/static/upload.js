// The artifacts page's upload: the chosen file goes as the body of one PUT (no multipart), with
// the page's CSRF value in a header; the console checks it as the leader would and answers in
// one line, shown under the form. A kept artifact joins the list in place (the page is fetched
// again and its table swapped in): no reload, the answer stays on screen.
(function () {
  "use strict";
  var form = document.getElementById("upload-form");
  if (!form) { return; }
  var result = document.getElementById("upload-result");
  form.addEventListener("submit", function (event) {
    event.preventDefault();
    var file = document.getElementById("upload-file").files[0];
    if (!file) { return; }
    result.hidden = false;
    result.className = "note";
    result.textContent = "uploading " + file.name + " …";
    fetch("/artifacts/upload?name=" + encodeURIComponent(file.name), {
      method: "PUT", body: file, credentials: "same-origin",
      headers: { "X-CSRF-Token": form.getAttribute("data-csrf"), "Content-Type": "application/octet-stream" }
    }).then(function (r) {
      return r.text().then(function (text) { return { ok: r.ok, text: text }; });
    }).then(function (answer) {
      result.className = answer.ok ? "note" : "error";
      result.textContent = answer.text;
      result.setAttribute("data-outcome", answer.ok ? "kept" : "refused");
      if (answer.ok) {
        fetch(location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } })
          .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
          .then(function (text) {
            var fresh = new DOMParser().parseFromString(text, "text/html").getElementById("artifacts");
            var table = document.getElementById("artifacts");
            if (fresh && table) { table.replaceWith(document.importNode(fresh, true)); }
            result.setAttribute("data-listed", "yes");
          })
          .catch(function () { location.reload(); });
      }
    }).catch(function (why) {
      result.className = "error";
      result.textContent = "the upload did not complete: " + why;
      result.setAttribute("data-outcome", "failed");
    });
  });
}());
