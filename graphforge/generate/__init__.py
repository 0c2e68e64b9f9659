"""Generation: text from an inference model and its tokenizer (``graphforge generate``).

A tool over an inference model, beside ``train/``: it reads how the model decodes from its
inputs and outputs (interface.py), runs it one token at a time (decoder.py), chooses each
token (sampling.py) and turns the tokens into text (text.py); generator.py holds them together.
It never reaches into training code.
"""

from graphforge.generate.generator import Generation, Generator, Stream
from graphforge.generate.sampling import Sampling, filtered
from graphforge.generate.text import Tokenizer, load_tokenizer

__all__ = ["Generation", "Generator", "Sampling", "Stream", "Tokenizer", "filtered", "load_tokenizer"]
