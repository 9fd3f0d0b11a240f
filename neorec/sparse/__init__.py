from neorec.sparse.batch import SparseBatch, lengths_to_offsets
from neorec.sparse.bounds import BOUNDS_MODES, IdBounds
from neorec.sparse.jagged import JaggedRows

__all__ = ["BOUNDS_MODES", "IdBounds", "JaggedRows", "SparseBatch", "lengths_to_offsets"]
