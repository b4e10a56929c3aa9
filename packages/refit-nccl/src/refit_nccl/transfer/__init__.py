"""The transfer: what moves and how. The plan (which tensor goes into which packed bucket),
the packing of buckets, the engines' geometry and the handshake that checks both sides agree
on it, the pipelined broadcast, the storage the buckets live in, and the stats a transfer
reports."""
