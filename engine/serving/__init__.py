"""The OpenAI-compatible server (``server``), its request and response schema (``openai_schema``)
and the committed tokens turned into text piece by piece (``text``: the server's streams and
`python -m engine generate --stream`)."""
