"""Text as the tokenizers take it: valid Unicode.

Without the tokenizer libraries, so that the web process can clean what a browser sends before it
goes to the engine (app/backend/conversation.py), and the tokenizers read the same text (model/tokenizer.py).
"""


def valid_unicode(text: str) -> str:
    """`text` with lone surrogates (e.g. half an emoji from a browser), which UTF-8 cannot encode, as U+FFFD."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text
