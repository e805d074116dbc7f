"""Applications built on the library, not part of it: the example job, the training recipes and the
demo (``pace demo``). Nothing in the library imports them."""
