"""The update chain: stages the runtime applies around a method's own client and server steps, for methods whose
phase uploads a model update to a sum (`Phase(..., model_update=True)`: FedAvg, FedProx, SCAFFOLD and plugins built
on them).

    client step (the method) -> DP-SGD in local training, sample level  (fedsim.training.dpsgd)
                              -> update Δ_k = upload − reference      (fedsim.transforms.updates)
                              -> encoded, counted, decoded (+ residual) (fedsim.transforms.compression)
    per client, in its worker -> poisoned data (an attacker's)          (fedsim.transforms.robustness)
                              -> clip to L2 norm C                      (fedsim.transforms.privacy)
                              -> quantised and masked, secure aggregation (fedsim.transforms.secure, .secagg)
    worker                    -> partial sum of the clipped (masked) updates, exact and order-independent; or each
                                 client's update, for a robust aggregator or a model attack
    server                    -> the masks removed; Gaussian noise on the sum, divided by the expected cohort, back
                                 to the upload's form; or the attackers' crafted updates, then the robust aggregator
                                 (fedsim.transforms.robustness, fedsim.transforms.robust)
                                 -> the method's server step
    accountant                -> epsilon after the round, or each client's (fedsim.transforms.accounting, .sample_dp)

Downloads of such a phase may be compressed too: the server sends the encoded change of its model since the
replica the clients hold, and they train from the replica (fedsim.transforms.download).

Every stage draws from named random streams (fedsim.rng), so the numbers do not depend on how many workers there
are. docs/privacy.md says what each key does.
"""

from fedsim.transforms.chain import UpdateChain, build_chain, check_availability, check_chain, check_round

CHAIN_COLUMNS = frozenset({"attack/success_rate", "attack/attackers", "attack/z", "attack/gamma", "aggregator/kept",
                           "aggregator/kept_malicious", "aggregator/skipped", "privacy/epsilon",
                           "privacy/clipped_fraction", "privacy/clip", "bytes_up"})
"""rounds.parquet columns of the chain that a reproduce table may show (docs/robustness.md, docs/privacy.md), and
bytes_up, which compression changes (docs/compression.md)."""

__all__ = ["CHAIN_COLUMNS", "UpdateChain", "build_chain", "check_availability", "check_chain", "check_round"]
