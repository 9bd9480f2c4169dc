"""The decode loop and its decisions: one `Decoder` for every surface (a single request is a batch of one), the
proposers behind one interface, the budget that sizes each step's trees, lossless verification, stops and text.

Pure functions at the heart (tree building, candidate merging, verification, budget allocation), engines at the
edge. Imports `engines`, never `serving`.
"""
