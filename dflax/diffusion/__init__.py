"""Masked diffusion LMs as drafters (DiffuSpec): the protocol they implement (`protocol`), and the pieces of
DiffuSpec's drafting that are independent of any one model: the token lattice (`lattice`), causal-consistency
path search (`cps`), adaptive draft length (`adl`) and window refinement (`refine`). The decode-loop proposer
is dflax.drafters.diffuspec_proposer."""
