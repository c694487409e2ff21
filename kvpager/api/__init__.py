"""Public APIs: the offline LLM class and the OpenAI-compatible server."""
