"""The update chain: stages the runtime applies around a method's own client and server steps, for methods whose
phase uploads a model update to a sum (`Phase(..., model_update=True)`: FedAvg, FedProx, SCAFFOLD and plugins built
on them).

    client step (the method) -> update Δ_k = upload − reference      (fedsim.transforms.updates)
    per client, in its worker -> clip to L2 norm C                      (fedsim.transforms.privacy)
    worker                    -> partial sum of the clipped updates, exact and order-independent
    server                    -> Gaussian noise on the sum, divided by the expected cohort, back to the upload's form
                                 -> the method's server step
    accountant                -> epsilon after the round                (fedsim.transforms.accounting)

Every stage draws from named random streams (fedsim.rng), so the numbers do not depend on how many workers there
are. docs/privacy.md says what each key does.
"""

from fedsim.transforms.chain import UpdateChain, build_chain, check_availability, check_chain, check_round

__all__ = ["UpdateChain", "build_chain", "check_availability", "check_chain", "check_round"]
