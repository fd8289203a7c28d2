"""Structured outputs: token masks from a grammar engine (llguidance), so a request's output always
matches its JSON schema, regex, choice list or grammar; and tool calling on top of them.

- params.py: `StructuredOutputsParams`, what a request asks for (light: no llguidance import);
- vocabulary.py: the model's tokenizer as llguidance sees it;
- compiler.py: constraint -> compiled grammar, bounded in size, time and memory, kept in an LRU cache;
- matcher.py: one request's grammar state, caught up with its output tokens before each mask;
- step_mask.py: the bitmask of one step's constrained rows, computed on the host while the device
  runs the step's forward, and its application to the logits on the device;
- tools.py and tool_parsers/: tools in the prompt, tool_choice as a grammar, tool calls out of the text.
"""

from deepinfer.core.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
