"""Plain torch modules, one mechanism per file, without fairseq registry code."""
