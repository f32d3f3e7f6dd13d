"""Text on the way in and out: the tokenizer the HTTP protocols use (prompts as strings, chat
messages, detokenized `text`), and the small one `make-model` trains for the local model."""
