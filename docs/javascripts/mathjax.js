// MathJax's configuration; MathJax itself is served by the site (tools/mathjax_hook.py), no CDN.
// pymdownx.arithmatex (generic mode) marks each formula with the class "arithmatex": only those
// are typeset, so a backslash-parenthesis in code or prose is left alone.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};
