"""Proofs and model checking over the spec (Z3, CrossHair, explicit-state search)."""
