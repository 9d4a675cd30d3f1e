// The copy button under an answer copies its Markdown, in which app/display.py wrote a backslash before
// each dollar that starts an amount ("\$5"), so that LaTeX does not read "$5 and $10" as a formula. The
// copied text gets those dollars back as the model wrote them. Only the answer's copy button writes plain
// text and HTML together (navigator.clipboard.write); a code block's button writes plain text alone
// (writeText) and is left as it is. The new item's values are promises, so write() is still called
// within the click, as browsers require.
(() => {
  const clipboard = navigator.clipboard;
  if (!clipboard || !clipboard.write || typeof ClipboardItem === "undefined") return;
  const write = clipboard.write.bind(clipboard);
  const escapedMoney = /\\\$(?=\d)/g;
  const unescape = (item) => {
    if (!item.types.includes("text/plain") || !item.types.includes("text/html")) return item;
    const parts = {};
    for (const type of item.types) parts[type] = item.getType(type);
    parts["text/plain"] = parts["text/plain"]
      .then((blob) => blob.text())
      .then((text) => new Blob([text.replace(escapedMoney, "$")], { type: "text/plain" }));
    return new ClipboardItem(parts);
  };
  clipboard.write = (items) => write(items.map(unescape));
})();
