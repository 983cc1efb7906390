"""Tool calls in the chat API: the request's tools and tool_choice (request.py), the per-family text formats a
model writes its calls in (parsers.py), and the stream that turns generated text into delta.tool_calls (stream.py)."""
