"""The OpenAI-compatible server (``server``) and its request and response schema
(``openai_schema``)."""
