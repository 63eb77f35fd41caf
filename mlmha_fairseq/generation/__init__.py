"""Decoding extensions: the GNMT length penalty for fairseq's SequenceGenerator."""
