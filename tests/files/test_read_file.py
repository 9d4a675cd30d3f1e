"""Reading an uploaded file into text (app/files/read.py): what is taken, as what text, and what is refused,
saying why."""

from __future__ import annotations

import json

import msgspec
import pytest
from support.pdfs import locked, make_pdf

from app.bounds import MAX_NAME_LENGTH
from app.files.read import (
    ACCEPTED_EXTENSIONS,
    ACCEPTED_MIME,
    MAX_FILE_BYTES,
    MAX_FILE_CHARS,
    MAX_PDF_PAGES,
    FileRefused,
    clean_name,
    read_file,
)
from app.messages import Attachment, ChatMessage, Generate


def refused(name: str, data: bytes) -> str:
    with pytest.raises(FileRefused) as caught:
        read_file(name, data)
    assert str(caught.value).startswith(f"{caught.value.name}: ")  # it names the file
    return str(caught.value)


# ---- taken ----------------------------------------------------------------------------------------

def test_text_is_read_as_utf8_with_line_ends_made_newlines():
    attachment = read_file("notes.txt", "Grüße\r\nline two\rline three\n".encode())
    assert attachment == Attachment(name="notes.txt", text="Grüße\nline two\nline three\n", size=29, pages=0)
    assert attachment.chosen is None  # the engine decides


def test_a_utf8_byte_order_mark_is_dropped():
    assert read_file("a.md", b"\xef\xbb\xbf# Title\n").text == "# Title\n"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_utf16_and_utf32_are_read_by_their_byte_order_mark(encoding):
    text = "naïve café, 日本語\n"
    data = text.encode(encoding)
    if encoding == "utf-16-be":
        data = b"\xfe\xff" + data
    assert read_file("a.txt", data).text == text


def test_control_characters_go_but_tab_newline_and_form_feed_stay():
    attachment = read_file("a.log", b"a\tb\x07c\x1b[31md\x0ce\x7ff\xc2\x85g\n")
    assert attachment.text == "a\tbc[31md\x0cefg\n"


def test_code_csv_and_json_are_taken_as_their_text():
    code = b"def f(x):\n\treturn x  # \xe2\x86\x92\n"
    assert read_file("f.py", code).text == code.decode()
    csv = b"name,age\nAda,36\n\"Lovelace, A\",37\n"
    assert read_file("people.csv", csv).text == csv.decode()
    document = {"a": [1, 2, {"b": None}], "c": "d"}
    assert json.loads(read_file("x.json", json.dumps(document).encode()).text) == document


def test_a_pdfs_pages_are_joined_with_form_feeds():
    pdf = make_pdf([["The first page (one)", "and its second line"], ["Page two says hello"]])
    attachment = read_file("report.pdf", pdf)
    assert attachment.text == "The first page (one)\nand its second line\fPage two says hello"
    assert (attachment.pages, attachment.size) == (2, len(pdf))


def test_a_pdf_with_some_empty_pages_keeps_their_place():
    attachment = read_file("r.pdf", make_pdf([["one"], [], ["three"]]))
    assert attachment.text.split("\f") == ["one", "", "three"]
    assert attachment.pages == 3


def test_a_pdf_locked_only_against_editing_is_read():
    assert read_file("r.pdf", locked(make_pdf([["open to all"]]), owner_only=True)).text == "open to all"


def test_the_extension_decides_whatever_its_case():
    assert read_file("README.MD", b"hi").text == "hi"
    assert read_file("Dockerfile", b"FROM scratch\n").text == "FROM scratch\n"


def test_the_lists_for_the_upload_dialog():
    assert {".txt", ".md", ".py", ".csv", ".json", ".pdf"} <= set(ACCEPTED_EXTENSIONS)
    assert all(e.startswith(".") and e == e.lower() for e in ACCEPTED_EXTENSIONS)
    assert {"text/plain", "application/pdf", "application/json", "text/csv", "text/markdown"} <= set(ACCEPTED_MIME)


def test_an_attachment_travels_to_the_engine():
    message = ChatMessage("user", "What is in it?", files=[read_file("a.txt", b"text \xf0\x9f\x98\x80")])
    request = Generate(id="1", model="m", messages=[message])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=Generate) == request


# ---- names ----------------------------------------------------------------------------------------

def test_a_name_is_its_last_path_part():
    assert clean_name("C:\\Users\\ada\\notes.txt") == "notes.txt"
    assert clean_name("../../etc/passwd.txt") == "passwd.txt"
    assert clean_name("") == "file"


def test_a_lone_surrogate_or_control_character_in_a_name_cannot_get_through():
    attachment = read_file("bad\ud800name\x00\n.txt", b"x")
    assert attachment.name == "bad\ufffdname .txt"
    attachment.name.encode()  # (would raise on a surrogate)
    msgspec.msgpack.encode(attachment)


def test_a_name_makes_no_markdown_link_or_image_where_it_is_shown():
    """The page shows names in Markdown (the line under a reply, a refusal, an export): a name was a link to
    another site, or an image the page fetched from one."""
    assert clean_name("[Session expired: sign in again](https:evil.example).md") == \
        "[Session expired: sign in again] (https:evil.example).md"
    assert clean_name("![x](https:203.0.113.9).md") == "![x] (https:203.0.113.9).md"
    assert clean_name("report (1) [final].pdf") == "report (1) [final].pdf"  # brackets alone are as they were


def test_a_long_name_is_cut_keeping_its_extension():
    name = clean_name("x" * 1000 + ".pdf")
    assert len(name) == MAX_NAME_LENGTH and name.endswith("….pdf")


# ---- refused --------------------------------------------------------------------------------------

def test_an_unknown_kind_is_refused_by_its_extension():
    assert "files of type .exe are not taken" in refused("setup.exe", b"MZ\x90\x00")
    assert "files without an extension are not taken" in refused("notes", b"text")


def test_a_renamed_binary_is_refused():
    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256))
    assert "binary data (NUL bytes)" in refused("photo.txt", png)
    assert "not UTF-8 text (byte 0 is 0xff)" in refused("photo.md", b"\xff\xd8\xff\xe0 JFIF")
    assert "is not a PDF" in refused("fake.pdf", b"just some text")
    assert "is not a PDF" in refused("fake.pdf", png)


def test_invalid_utf8_is_refused_naming_the_byte():
    assert "not UTF-8 text (byte 3 is 0xe9)" in refused("latin1.txt", "café".encode("latin-1"))


def test_nul_bytes_in_text_are_refused():
    assert "NUL bytes" in refused("a.csv", b"a,b\n1,\x002\n")


def test_utf16_with_a_lone_surrogate_is_refused():
    data = b"\xff\xfe" + "ok".encode("utf-16-le") + b"\x00\xd8" + "x".encode("utf-16-le")
    assert "not UTF-16-LE text" in refused("a.txt", data)


def test_invalid_json_is_refused_naming_where():
    assert "not valid JSON (line 2, column 1)" in refused("data.json", b'{"a": 1,\n}')


def test_empty_and_blank_files_are_refused():
    assert "is empty" in refused("a.txt", b"")
    assert "holds no text" in refused("a.txt", b" \n\t\x07\n")


def test_a_file_over_the_size_limit_is_refused_before_it_is_read():
    assert "files may be at most 20.0 MB" in refused("big.txt", b"a" * (MAX_FILE_BYTES + 1))
    assert "files may be at most" in refused("big.pdf", b"%PDF-" + b"\x00" * MAX_FILE_BYTES)  # never parsed


def test_megabytes_of_text_are_read():
    data = ("The quick brown fox. " * 100_000).encode()  # 2.1 MB
    assert len(read_file("big.txt", data).text) == len(data)


def test_text_past_the_character_limit_is_refused():
    data = "é".encode() * (MAX_FILE_CHARS + 1)  # under the byte limit, over the character limit
    assert len(data) <= MAX_FILE_BYTES
    assert f"at most {MAX_FILE_CHARS:,} are taken" in refused("long.txt", data)


def test_a_scanned_pdf_without_text_is_refused():
    assert "no text to read: its pages may be scanned images" in refused("scan.pdf", make_pdf([[], []]))


def test_a_password_protected_pdf_is_refused():
    assert "protected by a password" in refused("secret.pdf", locked(make_pdf([["hidden"]])))


def test_a_damaged_pdf_is_refused():
    pdf = make_pdf([["some text"]])
    assert "could not be read" in refused("cut.pdf", pdf[:len(pdf) // 3])


def test_a_pdf_with_too_many_pages_is_refused():
    assert f"at most {MAX_PDF_PAGES} are taken" in refused("long.pdf", make_pdf([["x"]] * (MAX_PDF_PAGES + 1)))
