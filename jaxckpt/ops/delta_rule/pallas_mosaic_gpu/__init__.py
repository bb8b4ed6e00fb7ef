"""The gated delta rule on Pallas Mosaic GPU kernels (Hopper): `pipeline` (the entries and their tuning), `intra` and
`kda_intra` (the intra-chunk passes), `state` (the state pass's lanes kernel), `gdn_fused` (GDN's fused pass), `split`
(the sequence split of the state pass). Design and measurements in README.md beside the package."""
