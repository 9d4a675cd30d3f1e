"""Files in /v1/chat/completions: OpenAI's "file" content parts read into a message's attachments (app/api/parse.py),
each refusal a 400 naming the message, the part and the file; the body's size limit; and the engine answering
with the file in its prompt (python -m app.api on a tiny checkpoint)."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import httpx
import openai
import pytest
from support.checkpoints import write_tiny_checkpoint
from support.pdfs import locked, make_pdf
from support.servers import ApiServer, server_env

from app.api.openai import ApiError
from app.api.parse import parse_chat
from app.api.routes import create_app
from app.bounds import MAX_FILE_BYTES, MAX_FILE_CHARS, MAX_FILES
from app.messages import Attachment, Done, Stats, Text

pytestmark = pytest.mark.timeout(240)

PROFILES = {"tiny": "/nowhere"}
PDF = make_pdf([["The harbor opens at dawn."], ["Boats leave at noon."]])


def file_part(data: bytes, filename: str | None = "x.pdf", media_type: str | None = "application/pdf") -> dict:
    encoded = base64.b64encode(data).decode()
    file = {"file_data": f"data:{media_type};base64,{encoded}" if media_type else encoded}
    if filename is not None:
        file["filename"] = filename
    return {"type": "file", "file": file}


def body(*parts: dict, text: str = "When do boats leave?") -> dict:
    return {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": [{"type": "text", "text": text}, *parts]}]}


def refused(request: dict) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_chat(request, PROFILES, "tiny")
    assert caught.value.status == 400
    return caught.value


# ---- reading file parts -------------------------------------------------------------------------

def test_a_pdf_as_a_data_url_becomes_the_messages_attachment():
    chat = parse_chat(body(file_part(PDF, "harbor.pdf")), PROFILES, "tiny")
    [message] = chat.conversation.messages
    assert message.content == "When do boats leave?"
    assert message.files == [Attachment("harbor.pdf", "The harbor opens at dawn.\fBoats leave at noon.", len(PDF), 2)]
    assert chat.conversation.chat_messages()[-1].files == message.files  # (what the backend sends on)


def test_bare_base64_and_several_files_in_their_order():
    chat = parse_chat(body(file_part(b"a,b\n1,2\n", "t.csv", None), file_part(b"# Notes", "n.md", "text/markdown")),
                      PROFILES, "tiny")
    assert [(f.name, f.text) for f in chat.conversation.messages[0].files] == [("t.csv", "a,b\n1,2\n"),
                                                                              ("n.md", "# Notes")]


def test_a_file_without_a_name_is_named_by_its_media_type():
    chat = parse_chat(body(file_part(PDF, None)), PROFILES, "tiny")
    assert chat.conversation.messages[0].files[0].name == "file.pdf"
    error = refused(body(file_part(PDF, None, None)))
    assert error.param == "messages[1].content[1].file.filename"
    assert "its extension tells the file's kind" in error.message


def test_a_message_of_text_alone_has_no_files():
    chat = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}, PROFILES, "tiny")
    assert chat.conversation.messages[0].files is None


def test_file_id_is_refused_by_name():
    error = refused(body({"type": "file", "file": {"file_id": "file-abc123"}}))
    assert "file_id is not supported: send file_data" in error.message
    assert error.param == "messages[1].content[1].file.file_id" and error.code == "unsupported_parameter"


def test_bad_base64_is_refused_naming_the_message_and_the_file():
    error = refused(body({"type": "file", "file": {"file_data": "data:application/pdf;base64,@@not*base64",
                                                   "filename": "report.pdf"}}))
    assert error.message == "messages[1].content[1] (report.pdf): file_data is not valid base64."
    assert refused(body({"type": "file", "file": {"file_data": "YWJj*", "filename": "a.txt"}})).param == \
        "messages[1].content[1].file.file_data"
    assert "without ';base64'" in refused(body({"type": "file", "file": {"file_data": "data:text/plain,hello",
                                                                          "filename": "a.txt"}})).message


def test_a_refused_file_is_a_400_saying_why():
    error = refused(body(file_part(locked(PDF), "secret.pdf")))
    assert error.message == ("messages[1].content[1]: secret.pdf: the PDF is protected by a password; send a copy "
                             "without one.") and error.param == "messages[1].content[1].file"
    assert "binary data (NUL bytes)" in refused(body(file_part(b"\x89PNG\r\n\x1a\n\x00\x00", "photo.txt"))).message
    assert "files of type .exe are not taken" in refused(body(file_part(b"MZ", "setup.exe"))).message
    assert "no text to read" in refused(body(file_part(make_pdf([[]]), "scan.pdf"))).message


def test_a_file_too_large_is_refused_before_it_is_decoded():
    huge = {"type": "file", "file": {"file_data": "A" * (MAX_FILE_BYTES // 3 * 4 + 8), "filename": "big.txt"}}
    error = refused(body(huge))
    assert error.message == "messages[1].content[1] (big.txt): the file is larger than 20 MB, the most a file may be."


def test_too_many_files_in_one_message_are_refused():
    error = refused(body(*[file_part(b"x", f"{i}.txt", "text/plain") for i in range(MAX_FILES + 1)]))
    assert f"at most {MAX_FILES} are taken in one message" in error.message and error.param == "messages[1].content"


def test_files_whose_text_together_is_too_long_are_refused():
    half = ("word " * (MAX_FILE_CHARS // 10 + 1)).encode()
    error = refused(body(file_part(half, "a.txt", "text/plain"), file_part(half, "b.txt", "text/plain")))
    assert error.message.startswith("messages[1]: a.txt, b.txt: together their text is") and \
        error.param == "messages[1].content"


def test_a_file_in_a_system_or_assistant_message_is_refused():
    for role in ("system", "assistant"):
        request = {"messages": [{"role": role, "content": [file_part(b"x", "a.txt", "text/plain")]},
                                {"role": "user", "content": "Hi"}]}
        assert refused(request).param.startswith("messages[0].content")


# ---- over HTTP ----------------------------------------------------------------------------------

class Answered:
    """A reply of one Done event."""

    id = "scripted"

    def cancel(self):
        pass

    async def __aiter__(self):
        yield Text("scripted", "At noon.")
        yield Done("scripted", "At noon.", "stop", Stats(prompt_tokens=40, new_tokens=3))


class Recording:
    """A backend that answers at once and keeps what it was asked."""

    profiles, default, ready, observers = PROFILES, "tiny", True, []

    def __init__(self):
        self.asked = []

    def stream(self, conversation, settings, **options):
        self.asked.append(conversation)
        return Answered()


def ask(backend, messages, max_body_mb: int = 4):
    async def run():
        transport = httpx.ASGITransport(app=create_app(backend, max_body_mb=max_body_mb))
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                                      http_client=httpx.AsyncClient(transport=transport)) as client:
            return await client.chat.completions.create(model="tiny", messages=messages)
    return asyncio.run(run())


def test_the_openai_client_sends_a_file_and_the_backend_gets_it():
    backend = Recording()
    completion = ask(backend, body(file_part(PDF, "harbor.pdf"))["messages"])
    assert completion.choices[0].message.content == "At noon." and completion.usage.prompt_tokens == 40
    [conversation] = backend.asked
    assert conversation.messages[0].files[0].text.endswith("Boats leave at noon.")


def test_a_body_past_the_limit_is_a_413_that_speaks_of_files():
    with pytest.raises(openai.APIStatusError) as caught:
        ask(Recording(), body(file_part(b"a" * (2**20), "big.txt", "text/plain"))["messages"], max_body_mb=1)
    assert caught.value.status_code == 413
    assert "takes 4/3 of its size as base64: files of up to 0.75 MB or so fit" in caught.value.message


def test_a_bad_file_over_http_is_a_400_in_openais_shape():
    with pytest.raises(openai.BadRequestError) as caught:
        ask(Recording(), body({"type": "file", "file": {"file_id": "file-1"}})["messages"])
    assert caught.value.body["param"] == "messages[1].content[1].file.file_id"


@pytest.mark.parametrize("junk", [None, [], "text", {"messages": "x"}, {"messages": [None, 1, {"content": {}}]},
                                  {"messages": [{"content": [None, "file", {"type": ["file"]}]}]}])
def test_a_body_of_any_shape_is_looked_at_for_files_without_error(junk):
    from app.api.parse import has_files
    assert has_files(junk) is False
    assert has_files(body(file_part(PDF))) is True and has_files(body()) is False


def test_requests_without_files_are_answered_while_many_files_are_being_read(monkeypatch):
    """Files are read two at a time on their own threads: more slow PDFs than asyncio has threads for
    other requests' parsing keep none of those requests waiting."""
    import concurrent.futures
    import threading

    import app.files.read
    release, reading = threading.Event(), []

    def slow_pdf(name, data, deadline):
        reading.append(name)
        assert release.wait(60)
        return "Boats leave at noon."

    monkeypatch.setattr(app.files.read, "_pdf_text", slow_pdf)
    default_threads = concurrent.futures.ThreadPoolExecutor()._max_workers  # asyncio's default executor's
    backend = Recording()

    async def run():
        transport = httpx.ASGITransport(app=create_app(backend))
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                                      http_client=httpx.AsyncClient(transport=transport)) as client:
            def ask(*parts):
                return asyncio.create_task(client.chat.completions.create(model="tiny",
                                                                          messages=body(*parts)["messages"]))
            with_files = [ask(file_part(PDF, f"{i}.pdf")) for i in range(default_threads + 2)]
            while len(reading) < 2:
                await asyncio.sleep(0.01)
            plain = await asyncio.wait_for(ask(), 10)  # answered while every file request waits
            assert len(reading) == 2 and not any(task.done() for task in with_files)
            release.set()
            return plain, await asyncio.wait_for(asyncio.gather(*with_files), 60)

    plain, answered = asyncio.run(run())
    assert plain.choices[0].message.content == "At noon." and len(answered) == default_threads + 2
    assert sorted(reading) == sorted(f"{i}.pdf" for i in range(default_threads + 2))


# ---- through the engine -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def api(tmp_path_factory):
    tiny = write_tiny_checkpoint(tmp_path_factory.mktemp("weights") / "tiny")
    folder = tmp_path_factory.mktemp("api")
    server = ApiServer(server_env(checkpoint=tiny, dtype="fp32", threads=1, max_context=2048),
                       log=folder / "api.log")
    try:
        server.wait_ready()
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    finally:
        server.stop()
    assert "Traceback" not in Path(folder / "api.log").read_text(errors="replace")


def test_the_engine_reads_the_file_whole_or_in_chunks_the_same_every_time(api):
    asked = dict(model="tiny", max_tokens=4, temperature=0)
    plain = api.chat.completions.create(messages=body(text="When?")["messages"], **asked)
    small = api.chat.completions.create(messages=body(file_part(PDF, "harbor.pdf"), text="When?")["messages"], **asked)
    assert small.usage.prompt_tokens > plain.usage.prompt_tokens + 10  # the file went in
    long_text = "".join(f"Line {i}: the harbor log says nothing of note today.\n" for i in range(3000)).encode()
    long = body(file_part(long_text, "log.txt", "text/plain"), text="When?")["messages"]
    first, again = (api.chat.completions.create(messages=long, **asked) for _ in range(2))
    assert small.usage.prompt_tokens < first.usage.prompt_tokens <= 2048 - 4  # chunks, within the context
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
