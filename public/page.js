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

// A command chosen in the Tools menu (Models, Export: app/web/chat.py COMMANDS) needs no words: Chainlit only
// puts its chip in the box, where an empty message had to be sent to run it. Here the chip's appearance in an
// empty box sends it at once. A command chosen with words already typed waits for Enter, as Chainlit's do.
(() => {
  const RUN_AT_ONCE = ["command-Models", "command-Export"];
  const sendWhenChosen = () => {
    const input = document.getElementById("chat-input");
    const submit = document.getElementById("chat-submit");
    if (!input || !submit || input.value.trim() !== "") return;
    if (!RUN_AT_ONCE.some((id) => document.getElementById(id))) return;
    setTimeout(() => {  // once the page has taken the command as chosen
      const button = document.getElementById("chat-submit");
      if (button && !button.disabled && RUN_AT_ONCE.some((id) => document.getElementById(id))) button.click();
    }, 50);
  };
  new MutationObserver(sendWhenChosen).observe(document.body, { childList: true, subtree: true });
})();
