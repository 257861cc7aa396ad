// Layout help that CSS alone cannot give, applied to every page once it is shown:
// - a wrapped code line continues under its own indentation plus four columns (a hanging indent),
//   so a wrapped line never looks like a new line at the left margin;
// - a table cell holding a sentence gets a minimum width, so the browser's automatic table layout
//   cannot squeeze its column to a few characters a line (a table wider than the text scrolls).
function hangingIndents(root) {
  for (const line of root.querySelectorAll("pre > code > span[id^='__span-']")) {
    const columns = line.textContent.match(/^ */)[0].length + 4;
    line.style.paddingLeft = `${columns}ch`;
    line.style.textIndent = `-${columns}ch`;
  }
}

function roomyCells(root) {
  for (const cell of root.querySelectorAll(".md-typeset table:not([class]) td")) {
    const characters = cell.textContent.trim().length;
    if (characters >= 20) cell.style.minWidth = `${Math.min(Math.ceil(characters / 2), 30)}ch`;
  }
}

function improveReading() {
  hangingIndents(document);
  roomyCells(document);
}

if (window.document$) {
  document$.subscribe(improveReading); // Material's page-shown signal (also on instant navigation)
} else {
  document.addEventListener("DOMContentLoaded", improveReading);
}
