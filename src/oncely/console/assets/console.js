// The console's one script (served from /console/assets, so the pages' CSP
// allows no inline script): a form with data-confirm asks before it submits.
document.addEventListener("submit", (event) => {
  const question = event.target.dataset.confirm;
  if (question && !window.confirm(question)) {
    event.preventDefault();
  }
});

// A job's page while the job is unfinished follows its live stream: the
// status, each step as it is stored, a streamed model call's text (a reset
// drops what came before it); at the end, the page again, as it ended.
const live = document.getElementById("live");
if (live && window.EventSource) {
  const source = new EventSource(live.dataset.stream);
  const text = document.getElementById("live-text");
  const steps = document.getElementById("live-steps");
  const data = (event) => JSON.parse(event.data);
  source.addEventListener("status", (event) => {
    document.getElementById("job-status").textContent = data(event).status;
  });
  source.addEventListener("step", (event) => {
    const step = data(event);
    const item = document.createElement("li");
    item.className = "live-step";
    item.textContent = `${step.key} (${step.kind}): ${step.status}`;
    steps.appendChild(item);
  });
  source.addEventListener("token", (event) => { text.textContent += data(event).text; });
  source.addEventListener("reset", () => { text.textContent = ""; });
  source.addEventListener("end", () => { source.close(); window.location.reload(); });
}
