from neorec.sparse.batch import SparseBatch, lengths_to_offsets
from neorec.sparse.jagged import JaggedRows

__all__ = ["JaggedRows", "SparseBatch", "lengths_to_offsets"]
