"""Semi-autoregressive drafters: a DFlash backbone whose rows are corrected along the drafted path
(DSpark, Domino)."""
