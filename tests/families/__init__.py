"""Model families defined outside titanlite, as a user would, to show that adding one needs no edit there."""
