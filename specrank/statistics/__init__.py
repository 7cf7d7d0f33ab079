"""The statistics every report shares: decoding laws and the paired prompt bootstrap."""
