// Layout help that CSS alone cannot give, applied to every page once it is shown:
// - a wrapped code line continues under its own indentation plus four columns (a hanging indent),
//   so a wrapped line never looks like a new line at the left margin;
// - a table cell holding a sentence gets a minimum width, so the browser's automatic table layout
//   cannot squeeze its column to a few characters a line (a table wider than the text scrolls).
// Each code line is its own block (pymdownx.highlight line_spans + extra.css), so the rendered text
// of a block would carry each newline twice; copying (the copy button and a selection inside one
// block) therefore takes the source text instead.
const CODE_LINE = "pre > code > span[id^='__span-']";

function hangingIndents(root) {
  for (const line of root.querySelectorAll(CODE_LINE)) {
    const columns = line.textContent.match(/^ */)[0].length + 4;
    line.style.paddingLeft = `${columns}ch`;
    line.style.textIndent = `-${columns}ch`;
  }
  for (const code of root.querySelectorAll("pre > code")) {
    code.setAttribute("data-copy", code.textContent.replace(/\s+$/, "")); // read by Material's copy button
  }
}

function roomyCells(root) {
  for (const cell of root.querySelectorAll(".md-typeset table:not([class]) td")) {
    const characters = cell.textContent.trim().length;
    if (characters >= 20) cell.style.minWidth = `${Math.min(Math.ceil(characters / 2), 30)}ch`;
  }
}

function copySourceText(event) {
  const selection = document.getSelection();
  if (!selection || selection.rangeCount !== 1 || selection.isCollapsed) return;
  const range = selection.getRangeAt(0);
  const start = range.commonAncestorContainer;
  const inside = (start.nodeType === Node.ELEMENT_NODE ? start : start.parentElement).closest("pre > code");
  if (!inside) return;
  event.clipboardData.setData("text/plain", range.cloneContents().textContent);
  event.preventDefault();
}

function improveReading() {
  hangingIndents(document);
  roomyCells(document);
}

document.addEventListener("copy", copySourceText);
if (window.document$) {
  document$.subscribe(improveReading); // Material's page-shown signal (also on instant navigation)
} else {
  document.addEventListener("DOMContentLoaded", improveReading);
}
