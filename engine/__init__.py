"""Plain and speculative decoding for vision-language models, with statistics."""
