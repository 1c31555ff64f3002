// The artifacts page's upload: the chosen file goes as the body of one PUT (no multipart), with
// the page's CSRF value in a header; the console checks it as the leader would and answers in
// one line, shown under the form. The page reloads to list a kept artifact.
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
      if (answer.ok) { setTimeout(function () { location.reload(); }, 1500); }
    }).catch(function (why) {
      result.className = "error";
      result.textContent = "the upload did not complete: " + why;
      result.setAttribute("data-outcome", "failed");
    });
  });
}());
