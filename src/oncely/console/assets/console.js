// The console's one script (served from /console/assets, so the pages' CSP
// allows no inline script): a form with data-confirm asks before it submits.
document.addEventListener("submit", (event) => {
  const question = event.target.dataset.confirm;
  if (question && !window.confirm(question)) {
    event.preventDefault();
  }
});
