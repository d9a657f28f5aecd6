"""Decoding: the generic loop (``decode``) and the device-resident runtime (``runtime``), what both
share (``loop``), the trees and their walk (``tree``, ``tree_kernel``), token selection
(``sampling``), drafters, grammar constraints, and the statistics and verdicts a generation records
(``stats``)."""
