// Live pages: a page that names a changes URL (data-poll) asks it every few seconds and
// reloads itself when the answer differs from the one it was rendered with (data-changes).
(function () {
  "use strict";
  var body = document.body;
  var url = body.dataset.poll;
  if (!url) {
    return;
  }
  var every = 1000 * (parseFloat(body.dataset.pollSeconds) || 2);
  var rendered = body.dataset.changes;
  var badge = document.querySelector(".live");
  if (badge) {
    badge.hidden = false;
  }
  function check() {
    fetch(url, { cache: "no-store", credentials: "same-origin" })
      .then(function (response) {
        return response.ok ? response.json() : null;
      })
      .then(function (answer) {
        if (answer && answer.changes !== rendered) {
          window.location.reload();
        } else {
          window.setTimeout(check, every);
        }
      })
      .catch(function () {
        window.setTimeout(check, every); // the server restarts: keep asking
      });
  }
  window.setTimeout(check, every);
})();
