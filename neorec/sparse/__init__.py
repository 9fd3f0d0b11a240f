from neorec.sparse.batch import SparseBatch, lengths_to_offsets

__all__ = ["SparseBatch", "lengths_to_offsets"]
