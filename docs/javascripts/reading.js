// Layout help that CSS alone cannot give, applied to every page once it is shown: tables that fit
// the text column.
// - A long name in a table cell (a parameter, a benchmark case, a shape) gets break opportunities
//   (<wbr>): after each underscore, and in code also after each dot, comma, slash, equals sign and
//   opening bracket. It can then wrap at a word boundary instead of widening its column past the
//   text, and no word is cut in the middle ("ValueErro" / "r").
// - A cell of a sentence or more (40 characters) is at least 6rem wide: the browser's automatic
//   table layout would otherwise give a long neighbour (a note column) the room and squeeze it to a
//   word a line (tools/check_site.py holds such a cell to 120 px).
// - A table of many columns is marked data-wide, which extra.css sets in a smaller font.
const BREAK_IN_TEXT = /(_)/; // split() keeps a captured separator as a part of its own
const BREAK_IN_CODE = /([_.,/=(\[])/;
const LONG_WORD = 12; // characters; shorter words never need a break
const SENTENCE = 40; // characters
const WIDE_TABLE_COLUMNS = 7;

function breakLongNames(root) {
  for (const cell of root.querySelectorAll(".md-typeset table:not([class]) :is(td, th)")) {
    if (cell.dataset.breakable) continue; // already done (instant navigation shows a page again)
    cell.dataset.breakable = "";
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    const texts = [];
    while (walker.nextNode()) texts.push(walker.currentNode);
    for (const text of texts) {
      if (!text.data.split(/\s+/).some(word => word.length >= LONG_WORD)) continue;
      const separator = text.parentElement.closest("code") ? BREAK_IN_CODE : BREAK_IN_TEXT;
      const pieces = text.data.split(separator).flatMap(
        (part, i) => (i % 2 === 1 ? [part, document.createElement("wbr")] : [part]));
      text.replaceWith(...pieces);
    }
  }
}

function roomySentences(root) {
  for (const cell of root.querySelectorAll(".md-typeset table:not([class]) td")) {
    if (cell.textContent.trim().length >= SENTENCE) cell.style.minWidth = "6rem";
  }
}

function markWideTables(root) {
  for (const table of root.querySelectorAll(".md-typeset table:not([class])")) {
    const columns = table.rows.length ? table.rows[0].cells.length : 0;
    if (columns >= WIDE_TABLE_COLUMNS) table.dataset.wide = "";
  }
}

function improveReading() {
  breakLongNames(document);
  roomySentences(document);
  markWideTables(document);
}

if (window.document$) {
  document$.subscribe(improveReading); // Material's page-shown signal (also on instant navigation)
} else {
  document.addEventListener("DOMContentLoaded", improveReading);
}
