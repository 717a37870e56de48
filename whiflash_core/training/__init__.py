"""Drafter training: self-distillation data (`whiflash train distill`) and drafter trainers."""
