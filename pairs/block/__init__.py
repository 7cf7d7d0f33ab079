"""Block-parallel drafters (`model.drafter_kind=block`): DFlash's layout, one forward per round
over the bonus token and mask placeholders, from the target's hidden states."""
