"""shardlab's version, in a module that imports nothing: `shardlab.__version__` re-exports it, and
the layers below the package's face (data/prepare.py's manifests) read it from here without
importing the face, which reaches up to the engines and the training loop's entry."""

__version__ = "0.1.0"
