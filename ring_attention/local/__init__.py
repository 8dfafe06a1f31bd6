"""The local layer: the one engine (the operators' boundary, the dispatch, the
dense backends, the merge)."""
