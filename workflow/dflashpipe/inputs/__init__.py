"""Stage code of what training and evaluation read: the prompt datasets (data), the target model
(target; tiny_target, the embedded default) and the tokenized training data (tokenize). The
drafter, decoding and evaluation packages build on it; it imports none of them."""
