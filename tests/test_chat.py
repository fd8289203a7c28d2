"""`deepinfer chat` as people use it: the REPL through a pseudo-terminal, `--prompt` output byte for
byte, and the history kept within the context."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer.cli.conversation import Conversation
from deepinfer.cli.repl import block_is_open, message_of
from deepinfer.core.errors import PromptTooLongError

pexpect = pytest.importorskip("pexpect")


def _count_words(messages: list[dict]) -> int:
    """A stand-in chat template: 2 tokens of framing per message plus one per word."""
    return sum(2 + len(m["content"].split()) for m in messages)


def test_the_oldest_exchanges_are_dropped_and_the_system_prompt_stays():
    conversation = Conversation("be brief")  # 4 tokens
    for i in range(3):
        conversation.add("user", f"question {i} " + "w " * 8)  # 12 tokens each
        conversation.add("assistant", f"answer {i} " + "w " * 8)  # 12 each
    # 4 + 6 * 12 + 4 ("new question" as the pending message) = 80; with 20 for the answer: 100.
    fit = conversation.fit("new question", _count_words, max_model_len=100, max_tokens=20)
    assert fit.dropped_turns == 0 and fit.max_tokens == 20
    fit = conversation.fit("new question", _count_words, max_model_len=99, max_tokens=20)
    assert fit.dropped_turns == 2 and fit.max_tokens == 20  # one exchange (12 + 12) freed 24 tokens
    assert [t.content.split()[:2] for t in conversation.turns] == [["question", "1"], ["answer", "1"],
                                                                    ["question", "2"], ["answer", "2"]]
    assert conversation.messages("x")[0] == {"role": "system", "content": "be brief"}


def test_a_message_that_fills_the_context_alone_gets_what_is_left_or_an_error():
    conversation = Conversation(None)
    conversation.add("user", "old " * 10)
    conversation.add("assistant", "reply " * 10)
    fit = conversation.fit("w " * 40, _count_words, max_model_len=50, max_tokens=20)  # 42 tokens alone
    assert fit.dropped_turns == 2 and fit.max_tokens == 8 and conversation.turns == []
    conversation.add("user", "kept")
    with pytest.raises(PromptTooLongError, match="context holds 50"):
        conversation.fit("w " * 60, _count_words, max_model_len=50, max_tokens=20)
    assert [t.content for t in conversation.turns] == ["kept"]  # nothing lost to a message that cannot fit


@pytest.mark.parametrize(("text", "is_open", "message"), [
    ("hello", False, "hello"),
    ('"""', True, None),
    ('"""\nfirst line', True, None),
    ('"""\nfirst line\nsecond\n"""', False, "first line\nsecond"),
    ('"""one line"""', False, "one line"),
    ('""""""', False, ""),
])
def test_a_triple_quote_block_is_one_message(text, is_open, message):
    assert block_is_open(text) is is_open
    if message is not None:
        assert message_of(text) == message


@pytest.fixture
def chat_home(tmp_path, smollm2_gguf) -> Path:
    """A deepinfer cache of its own (the chat history goes there), holding the default model."""
    (tmp_path / "models").mkdir()
    target = tmp_path / "models" / smollm2_gguf.name
    try:  # a regular file (the loader refuses links leaving a model's directory), without a 93 MB copy
        os.link(smollm2_gguf, target)
    except OSError:
        shutil.copyfile(smollm2_gguf, target)
    return tmp_path


def _spawn_chat(chat_home: Path, *args: str, log_name: str = "chat.log"):
    env = {**os.environ, "DEEPINFER_CACHE_DIR": str(chat_home), "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm"}
    child = pexpect.spawn(sys.executable, ["-m", "deepinfer", "chat", *args], env=env, encoding="utf-8",
                          timeout=60, dimensions=(40, 100))
    child.logfile_read = open(chat_home / log_name, "w")  # noqa: SIM115 - closed with the child
    return child


def _history_entries(history_file: Path) -> list[str]:
    """prompt_toolkit's FileHistory: '# time' opens an entry, each of its lines starts with '+'."""
    entries: list[list[str]] = []
    for line in history_file.read_text().splitlines():
        if line.startswith("#"):
            entries.append([])
        elif line.startswith("+"):
            entries[-1].append(line[1:])
    return ["\n".join(entry) for entry in entries]


@pytest.mark.slow
def test_repl_ctrl_c_stops_an_answer_and_the_conversation_goes_on(chat_home):
    child = _spawn_chat(chat_home, "--temperature", "0", "--max-tokens", "60", "--max-model-len", "512")
    child.expect(">>>")
    child.send("/help\r")
    child.expect("/reset")
    child.expect(">>>")
    child.send("Tell me a long story about a dragon who learns to bake bread.\r")
    child.expect(r"bread\.[^\n]*\n")  # the line is submitted; the answer follows
    child.expect(r"[A-Za-z]{2,}")  # tokens are arriving
    child.sendintr()
    child.expect(r"\[answer interrupted")
    child.expect(">>>")
    # A \"\"\" block over several lines is one message, answered once.
    child.send('"""\r')
    child.expect(r"\.\.\.")
    child.send("What is the capital\r")
    child.send("of France?\r")
    child.send('"""\r')
    child.expect("Paris")
    child.expect(">>>")
    # So is a pasted block (bracketed paste), newlines and all.
    child.send("\x1b[200~Say hello\nin French.\x1b[201~\r")
    child.expect(">>>")
    # A message too long for the history: the oldest turns go, the system prompt stays, the user is told.
    child.send("Count these words: " + "apple " * 440 + "\r")
    child.expect("oldest turns were dropped")
    child.expect(">>>")
    child.send("/reset\r")
    child.expect("kept: no system prompt")
    child.expect(">>>")
    child.send("/exit\r")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    entries = _history_entries(chat_home / "chat_history")
    assert entries[:4] == ["/help", "Tell me a long story about a dragon who learns to bake bread.",
                           '"""\nWhat is the capital\nof France?\n"""', "Say hello\nin French."]
    assert entries[-2:] == ["/reset", "/exit"]


@pytest.mark.slow
@pytest.mark.parametrize("key", ["\x03", "\x04"])  # Ctrl-C, Ctrl-D
def test_repl_leaves_at_once_on_ctrl_c_or_ctrl_d_at_an_empty_prompt(chat_home, tiny_llama_dir, key):
    child = _spawn_chat(chat_home, "--model", str(tiny_llama_dir))
    child.expect(">>>")
    child.send("half a thought")
    child.send("\x03")  # Ctrl-C with text clears the line and stays
    time.sleep(1.0)
    assert child.isalive()
    child.send(key)
    child.expect(pexpect.EOF, timeout=15)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.slow
def test_ctrl_c_while_the_model_loads_exits_at_once(chat_home):
    child = _spawn_chat(chat_home)
    child.expect("loading model")
    child.sendintr()
    start = time.monotonic()
    child.expect(pexpect.EOF, timeout=15)
    child.close()
    assert ">>>" not in (chat_home / "chat.log").read_text()
    assert child.exitstatus == 130
    assert time.monotonic() - start < 5


@pytest.mark.slow
def test_chat_prompt_writes_the_generated_text_byte_for_byte(smollm2_gguf):
    from deepinfer import LLM, SamplingParams

    question = ("Write two long sentences about the sea with a :smile: emoji code, [bold]square brackets[/bold] "
                "and    runs of spaces.")
    expected = LLM(str(smollm2_gguf)).chat([{"role": "user", "content": question}],
                                           SamplingParams(temperature=0, max_tokens=40))[0].text
    result = subprocess.run([sys.executable, "-m", "deepinfer", "chat", "--model", str(smollm2_gguf), "--prompt",
                             question, "--temperature", "0", "--max-tokens", "40"], check=False, capture_output=True,
                            timeout=300, env={**os.environ, "COLUMNS": "20"})
    assert result.returncode == 0, result.stderr
    assert len(expected) > 60 and "\n" not in expected.strip()  # longer than the 20 columns it must not wrap at
    assert result.stdout == (expected + "\n").encode("utf-8")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_chat_prompt_on_a_gpu_answers_paris(smollm2_gguf):
    result = subprocess.run([sys.executable, "-m", "deepinfer", "chat", "--prompt", "What is the capital of France?",
                             "--temperature", "0", "--max-tokens", "16"], check=False, capture_output=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert b"Paris" in result.stdout
