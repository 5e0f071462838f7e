//! An arithmetic calculator: numbers, `+ - * /`, unary minus and parentheses, parsed and
//! evaluated here (never executed as code). Arguments: `{"expression": "<text>"}`.

use serde_json::{json, Map, Value};

use super::{Tool, ToolOutput, ToolState};

/// The class name a tool file gives it.
pub const CLASS_NAME: &str = "burn_rlhf.tools.Calculator";

/// Expressions longer than this are refused (a model looping on digits).
const MAX_EXPRESSION_CHARS: usize = 512;

/// The calculator tool.
#[derive(Debug, Clone)]
pub struct Calculator {
    schema: Value,
}

impl Calculator {
    /// From a tool file entry; `config` takes no keys.
    pub fn new(config: &Map<String, Value>, schema: Value) -> Result<Self, String> {
        if let Some(key) = config.keys().find(|k| k.as_str() != "type") {
            return Err(format!(
                "config: unknown key `{key}` (the calculator takes none)"
            ));
        }
        Ok(Self { schema })
    }

    /// The schema of the built-in under the name `calculator`.
    pub fn default_schema() -> Value {
        json!({
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluates an arithmetic expression with + - * / and parentheses.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "expression": {"type": "string", "description": "The expression, e.g. 1234 * 567"}
                    },
                    "required": ["expression"]
                }
            }
        })
    }
}

impl Tool for Calculator {
    fn schema(&self) -> &Value {
        &self.schema
    }

    fn create(&self, _: &Map<String, Value>) -> Result<Box<dyn ToolState>, String> {
        Ok(Box::new(CalculatorState))
    }
}

struct CalculatorState;

impl ToolState for CalculatorState {
    fn call(&mut self, arguments: &Map<String, Value>) -> Result<ToolOutput, String> {
        let expr = match arguments.get("expression") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => return Err("expected {\"expression\": \"<arithmetic>\"}".into()),
        };
        Ok(ToolOutput {
            text: format_number(evaluate(&expr)?),
            reward: None,
        })
    }
}

/// The value of an arithmetic expression.
pub fn evaluate(expr: &str) -> Result<f64, String> {
    if expr.chars().count() > MAX_EXPRESSION_CHARS {
        return Err(format!(
            "expression longer than {MAX_EXPRESSION_CHARS} characters"
        ));
    }
    let tokens = lex(expr)?;
    let mut p = Parser { tokens, at: 0 };
    let v = p.sum()?;
    if p.at != p.tokens.len() {
        return Err(format!("unexpected `{}`", p.tokens[p.at].text()));
    }
    if !v.is_finite() {
        return Err("the result is not a finite number".into());
    }
    Ok(v)
}

/// An integral value without a fraction, others with up to 10 decimals, trailing zeros dropped.
pub fn format_number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        return format!("{}", v as i64);
    }
    let s = format!("{v:.10}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Number(f64),
    Op(char),
}

impl Token {
    fn text(&self) -> String {
        match self {
            Token::Number(n) => format_number(*n),
            Token::Op(c) => c.to_string(),
        }
    }
}

fn lex(expr: &str) -> Result<Vec<Token>, String> {
    let mut out = Vec::new();
    let chars: Vec<char> = expr.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            ' ' | '\t' | '\n' => i += 1,
            '+' | '-' | '*' | '/' | '(' | ')' => {
                out.push(Token::Op(c));
                i += 1;
            }
            '×' | 'x' => {
                out.push(Token::Op('*'));
                i += 1;
            }
            '÷' => {
                out.push(Token::Op('/'));
                i += 1;
            }
            c if c.is_ascii_digit() || c == '.' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_digit() || chars[i] == '.' || chars[i] == ',')
                {
                    i += 1;
                }
                let text: String = chars[start..i].iter().filter(|&&c| c != ',').collect();
                let n = text
                    .parse::<f64>()
                    .map_err(|_| format!("`{text}` is not a number"))?;
                out.push(Token::Number(n));
            }
            other => {
                return Err(format!(
                    "unexpected character `{other}` (numbers, + - * / and parentheses only)"
                ))
            }
        }
    }
    if out.is_empty() {
        return Err("empty expression".into());
    }
    Ok(out)
}

struct Parser {
    tokens: Vec<Token>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at)
    }

    fn sum(&mut self) -> Result<f64, String> {
        let mut v = self.product()?;
        while let Some(Token::Op(op @ ('+' | '-'))) = self.peek().cloned() {
            self.at += 1;
            let rhs = self.product()?;
            v = if op == '+' { v + rhs } else { v - rhs };
        }
        Ok(v)
    }

    fn product(&mut self) -> Result<f64, String> {
        let mut v = self.unary()?;
        while let Some(Token::Op(op @ ('*' | '/'))) = self.peek().cloned() {
            self.at += 1;
            let rhs = self.unary()?;
            if op == '/' && rhs == 0.0 {
                return Err("division by zero".into());
            }
            v = if op == '*' { v * rhs } else { v / rhs };
        }
        Ok(v)
    }

    fn unary(&mut self) -> Result<f64, String> {
        match self.peek().cloned() {
            Some(Token::Op('-')) => {
                self.at += 1;
                Ok(-self.unary()?)
            }
            Some(Token::Op('+')) => {
                self.at += 1;
                self.unary()
            }
            _ => self.atom(),
        }
    }

    fn atom(&mut self) -> Result<f64, String> {
        match self.peek().cloned() {
            Some(Token::Number(n)) => {
                self.at += 1;
                Ok(n)
            }
            Some(Token::Op('(')) => {
                self.at += 1;
                let v = self.sum()?;
                match self.peek() {
                    Some(Token::Op(')')) => {
                        self.at += 1;
                        Ok(v)
                    }
                    _ => Err("missing `)`".into()),
                }
            }
            Some(t) => Err(format!("unexpected `{}`", t.text())),
            None => Err("the expression ends too early".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evaluates_arithmetic_and_refuses_the_rest() {
        assert_eq!(evaluate("1234 * 567").unwrap(), 699_678.0);
        assert_eq!(evaluate("2 + 3 * (4 - 1) / 2").unwrap(), 6.5);
        assert_eq!(evaluate("-(2+3)*-2").unwrap(), 10.0);
        assert_eq!(evaluate("1,000 / 8").unwrap(), 125.0);
        assert_eq!(format_number(evaluate("10/4").unwrap()), "2.5");
        assert_eq!(format_number(evaluate("1/3").unwrap()), "0.3333333333");
        assert_eq!(format_number(699_678.0), "699678");
        for bad in [
            "",
            "1 +",
            "2 ** 3",
            "(1",
            "1 / 0",
            "import os",
            "1..2",
            "3 4",
        ] {
            assert!(evaluate(bad).is_err(), "{bad}");
        }
        let mut s = CalculatorState;
        let args = |e: &str| {
            serde_json::json!({"expression": e})
                .as_object()
                .unwrap()
                .clone()
        };
        assert_eq!(s.call(&args("12*12")).unwrap().text, "144");
        assert!(s.call(&Map::new()).is_err());
    }
}
