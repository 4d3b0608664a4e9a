"""Tool calling (OpenAI `tools` / `tool_choice`), shared by the server and `LLM.chat`.

parsers.py   the model families' tool-call formats: find calls in output text, write calls as text
choice.py    tools + tool_choice -> what to render and which structured-output constraint to apply
messages.py  conversations with tool results and assistant tool_calls -> chat-template input
"""

from conveyor.tools.choice import ToolPlan, plan_tools
from conveyor.tools.messages import render_conversation
from conveyor.tools.parsers import ToolCall, ToolParser, parser_for

__all__ = ["ToolCall", "ToolParser", "ToolPlan", "parser_for", "plan_tools", "render_conversation"]
