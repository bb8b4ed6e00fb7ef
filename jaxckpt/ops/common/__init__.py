"""Pieces shared by the recurrent ops (GDN, KDA, SSD, conv1d): references, chunk stages, state passing."""
