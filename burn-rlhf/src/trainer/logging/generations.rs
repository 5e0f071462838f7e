//! The validation generations `trainer.log_val_generations` shows: which, and as text.

/// One validation generation shown by `trainer.log_val_generations`.
#[derive(Debug, Clone, PartialEq)]
pub struct ValGeneration {
    /// The prompt, decoded.
    pub input: String,
    /// The response, decoded.
    pub output: String,
    /// Its score.
    pub score: f64,
}

/// `n` of `all`, the same ones every time: sorted by prompt (then response), then a draw seeded
/// with 42 (verl sorts by input and shuffles with NumPy's generator seeded 42; the draw here is
/// `rand`'s, so the rows picked are others than verl's).
pub fn pick_generations(mut all: Vec<ValGeneration>, n: usize) -> Vec<ValGeneration> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    all.sort_by(|a, b| (&a.input, &a.output).cmp(&(&b.input, &b.output)));
    all.shuffle(&mut rand::rngs::StdRng::seed_from_u64(42));
    all.truncate(n);
    all
}

/// `samples` as one markdown text: a section a generation.
pub fn generations_text(step: usize, samples: &[ValGeneration]) -> String {
    let mut text = format!("**Validation generations, step {step}**\n\n");
    for (i, s) in samples.iter().enumerate() {
        text.push_str(&format!(
            "### Sample {}\n**Input:** {}\n\n**Output:** {}\n\n**Score:** {}\n\n---\n\n",
            i + 1,
            s.input,
            s.output,
            s.score
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_generations_are_picked_whatever_their_order() {
        let all: Vec<ValGeneration> = (0..20)
            .map(|i| ValGeneration {
                input: format!("prompt {i:02}"),
                output: format!("answer {i}"),
                score: i as f64,
            })
            .collect();
        let mut reversed = all.clone();
        reversed.reverse();
        let (a, b) = (
            pick_generations(all.clone(), 3),
            pick_generations(reversed, 3),
        );
        assert_eq!(a.len(), 3);
        assert_eq!(a, b);
        assert_eq!(pick_generations(all.clone(), 50).len(), 20);
        let text = generations_text(7, &a);
        assert!(
            text.contains("step 7")
                && text.contains("### Sample 3")
                && !text.contains("### Sample 4")
        );
    }
}
