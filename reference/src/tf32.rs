//! TF32 rounding of matrix-product operands. STUB.
