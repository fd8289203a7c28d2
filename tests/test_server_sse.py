"""SSETemplate: a chunk rendered from its template is the same characters as sse_json of the whole payload."""

from hypothesis import given
from hypothesis import strategies as st

from deepinfer.core.server.serving import SSETemplate, sse_json

# Text that JSON escapes (quotes, backslashes, control characters), line breaks SSE readers split on, and
# characters outside the BMP.
TRICKY = st.text(st.sampled_from(['"', "\\", "\n", "\r", "\t", "\x00", "\x1f", "\x7f", "\x85", "\u2028",
                                  "\u2029", "é", "世", "🎉", "\ue000", "a", " ", "/"]), max_size=12)


def completion_chunk(index, text, finish_reason, usage_field):
    return {"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": 'm"\u2028\\',
            "system_fingerprint": None, "choices": [{"index": index, "text": text, "logprobs": None,
                                                     "finish_reason": finish_reason}], **usage_field}


@given(text=TRICKY, index=st.integers(0, 1000), finish_reason=st.sampled_from([None, "stop", "length"]),
       usage_field=st.sampled_from([{}, {"usage": None}]))
def test_rendered_chunk_equals_the_payloads_json(text, index, finish_reason, usage_field):
    slot = SSETemplate.slot
    template = SSETemplate(completion_chunk(slot(0), slot(1), slot(2), usage_field), 3)
    assert template.render(index, text, finish_reason) == sse_json(
        completion_chunk(index, text, finish_reason, usage_field))


def test_slots_nested_in_the_payload_render_in_order():
    slot = SSETemplate.slot
    payload = {"choices": [{"index": slot(0), "delta": {"content": slot(1), "reasoning_content": None}}], "a": 1}
    template = SSETemplate(payload, 2)
    assert template.render(3, "hi\n") == '{"choices": [{"index": 3, "delta": {"content": "hi\\n", ' \
                                         '"reasoning_content": null}}], "a": 1}'
