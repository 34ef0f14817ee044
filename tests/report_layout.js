// Measures the rendered report page (tests/test_report.py injects this before </body>): text that
// leaves the window or its chart, clipped boxes, overlapping axis ticks, tiny fonts. The result is
// written into the DOM as JSON in <pre id="layout-result">, which `chromium --dump-dom` prints.
(function () {
  const W = window.innerWidth, problems = [];
  const visible = (el) => el.getClientRects().length > 0 && getComputedStyle(el).visibility !== "hidden";
  const name = (el) => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") + (el.className ? "." + el.className : "");
  const texty = Array.from(document.body.querySelectorAll("*")).filter(
    (el) => visible(el) && Array.from(el.childNodes).some((n) => n.nodeType === 3 && n.textContent.trim()));
  for (const el of texty) {
    const r = el.getBoundingClientRect(), fs = parseFloat(getComputedStyle(el).fontSize);
    if (r.left < -0.5 || r.right > W + 0.5) problems.push(`${name(el)} leaves the window: ${r.left}..${r.right} of ${W}`);
    if (fs < 10) problems.push(`${name(el)} font ${fs}px`);
    if (el.scrollWidth > el.clientWidth + 1 && getComputedStyle(el).overflowX !== "visible")
      problems.push(`${name(el)} clipped: scrollWidth ${el.scrollWidth} > ${el.clientWidth}`);
  }
  for (const fig of document.querySelectorAll("figure.chart")) {
    const f = fig.getBoundingClientRect();
    for (const el of fig.querySelectorAll("*")) {
      if (!visible(el)) continue;
      const r = el.getBoundingClientRect();
      if (r.left < f.left - 0.5 || r.right > f.right + 0.5) problems.push(`${name(el)} leaves chart ${fig.id}`);
    }
    const ticks = Array.from(fig.querySelectorAll(".tick")).map((t) => t.getBoundingClientRect())
      .sort((a, b) => a.left - b.left);
    for (let i = 1; i < ticks.length; i++)
      if (ticks[i].left < ticks[i - 1].right - 0.5) problems.push(`axis ticks overlap in ${fig.id}`);
  }
  if (document.documentElement.scrollWidth > W + 1)
    problems.push(`page scrolls sideways: ${document.documentElement.scrollWidth} > ${W}`);
  const charts = {};
  for (const fig of document.querySelectorAll("figure.chart")) {
    const r = fig.getBoundingClientRect();
    charts[fig.id] = {width: r.width, height: r.height, boxes: fig.querySelectorAll(".box,.layer,.stack div").length,
                      ticks: fig.querySelectorAll(".tick").length, legend: fig.querySelectorAll(".legend > span").length};
  }
  const out = document.createElement("pre");
  out.id = "layout-result";
  out.textContent = JSON.stringify({width: W, problems: problems, charts: charts, texts: texty.length});
  document.body.appendChild(out);
})();
