//! A teacher of on-policy distillation (`distillation.teacher_models.<name>`): a frozen model of
//! its own family, size and dtype, loaded for the student's tokenizer, with the rows it scores.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn_rlhf_models::{CausalLm, Tokenizer, TransformerConfig};

use crate::config::TeacherSettings;
use crate::error::TrainError;
use crate::loading::load_policy;

/// One frozen teacher.
#[derive(Clone)]
pub struct Teacher<B: Backend> {
    /// The rows it scores: those whose `data_source` is this; `None`: every row.
    pub key: Option<String>,
    /// Its entry in `distillation.teacher_models` (for messages).
    pub name: String,
    /// The model.
    pub model: CausalLm<B>,
    /// Its shape.
    pub config: TransformerConfig,
}

impl<B: Backend> std::fmt::Debug for Teacher<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Teacher")
            .field("name", &self.name)
            .field("key", &self.key)
            .finish()
    }
}

impl<B: Backend> Teacher<B> {
    /// A teacher given in code: `model` scores the rows of `key` (`None`: every row).
    pub fn new(
        name: &str,
        key: Option<&str>,
        model: CausalLm<B>,
        config: TransformerConfig,
    ) -> Self {
        Self {
            key: key.map(str::to_string),
            name: name.to_string(),
            model,
            config,
        }
    }

    /// The teacher `settings` name, loaded on `device`; it reads the student's token ids, so its
    /// tokenizer must be the student's (`student`).
    pub fn load(
        settings: &TeacherSettings,
        student: &Tokenizer,
        device: &B::Device,
    ) -> Result<Self, TrainError> {
        let key = format!("distillation.teacher_models.{}.model_path", settings.name);
        let loaded = load_policy::<B>(&settings.model_path, None, (&key, &key), device)?;
        if !loaded.tokenizer.same_vocabulary(student) {
            return Err(TrainError::config(
                &key,
                format!(
                    "{}'s tokenizer is not the student's ({} tokens against {}): a teacher \
                     scores the student's token ids",
                    settings.model_path,
                    loaded.tokenizer.vocab_size(),
                    student.vocab_size()
                ),
            ));
        }
        Ok(Self {
            key: settings.key.clone(),
            name: settings.name.clone(),
            model: loaded.model,
            config: loaded.config,
        })
    }

    /// The teacher with its weights in `dtype` (`None`: as they are), in which its pass then
    /// computes.
    pub fn held_in(self, dtype: Option<burn::tensor::FloatDType>) -> Self {
        match dtype {
            Some(dtype) => Self {
                model: self.model.cast(dtype),
                ..self
            },
            None => self,
        }
    }

    /// A copy on `device`.
    pub fn on(&self, device: &B::Device) -> Self {
        Self {
            model: self.model.clone().fork(device),
            ..self.clone()
        }
    }
}
